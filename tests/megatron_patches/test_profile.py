"""Cost profiles: the JSON round trip, refusals naming the field, interpolation, and where auto reads one."""

import json
import re

import pytest

from megatron_patches import profile
from megatron_patches.args import WallFacerConfig
from megatron_patches.profile import Collective, Curve, Kernel, from_json, load, profile_path, save
from megatron_patches.specs import gpu_profile, spec_profile


def test_round_trip(tmp_path):
    prof = gpu_profile("a100", 8, 100, 1, "ethernet")
    path = str(tmp_path / "p.json")
    save(prof, path)
    got = load(path)
    assert got.inter.alpha_s == pytest.approx(prof.inter.alpha_s, rel=1e-12)
    assert got == type(prof)(**{**vars(prof), "inter": got.inter, "intra": got.intra})
    assert got.intra.alpha_s == pytest.approx(prof.intra.alpha_s, rel=1e-12)
    with open(path) as f:
        raw = json.load(f)
    assert raw["format"] == profile.FORMAT
    assert raw["intra"] == {"alpha_us": pytest.approx(3.0), "gbytes": 300.0}
    # 100 Gb/s Ethernet: the TCP payload share of the line rate (specs.py), one NIC for the node
    assert raw["node_gbytes"] == pytest.approx(12.5 * 1448 / 1538)


def test_host_work_round_trips_and_is_priced_per_plan(tmp_path):
    from dataclasses import replace

    from megatron_patches.choice import plan_s
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    prof = spec_profile(8, 10.0, 10.0)
    timed = replace(prof, host={"8 2 1 team-major": 0.25})
    save(timed, str(tmp_path / "h.json"))
    assert load(str(tmp_path / "h.json")).host == {"8 2 1 team-major": 0.25}
    assert timed.host_s(8, 2, 1, "team-major") == 0.25 and timed.host_s(8, 1, 1, "team-major") == 0.0
    sh, nodes = Shard(512, 1, 8, 8, 64, 4, 4), [0] * 8
    base = [plan_s(8, sh, nodes, Topology.from_profile(prof), u, 1, "team-major") for u in (1, 2)]
    with_host = [plan_s(8, sh, nodes, Topology.from_profile(timed), u, 1, "team-major") for u in (1, 2)]
    assert with_host == [base[0], pytest.approx(base[1] + 0.25, rel=1e-12)]


def test_host_work_decides_the_slot_order_within_one_team_size():
    """auto's order for one C weighs the same seconds the plan is priced at: the faster order by the
    estimate alone loses once its measured host work exceeds the gap, and the plan's seconds are its own."""
    from dataclasses import replace

    from megatron_patches.choice import plan, plan_s
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    prof = spec_profile(2, 100.0, 10.0)  # four nodes of 2: the orders cross nodes differently
    sh, nodes = Shard(512, 1, 8, 8, 64, 4, 4), [r // 2 for r in range(8)]
    topo = Topology.from_profile(prof)
    bare = {o: plan_s(8, sh, nodes, topo, 1, 2, o) for o in ("team-major", "ring-major")}
    fast, slow = sorted(bare, key=bare.get)
    assert bare[fast] < bare[slow]
    assert plan(8, sh, nodes, topo, 1, 2).order == fast
    gap = bare[slow] - bare[fast]
    for extra, want in ((0.5 * gap, fast), (2 * gap, slow)):
        topo = Topology.from_profile(replace(prof, host={f"8 1 2 {fast}": extra}))
        got = plan(8, sh, nodes, topo, 1, 2)
        assert got.order == want
        assert got.seconds == pytest.approx(plan_s(8, sh, nodes, topo, 1, 2, want), rel=1e-12)


def test_an_exact_call_round_trips_and_replaces_the_curve_for_that_call_only(tmp_path):
    """Profile.calls: a measured call's seconds are what Topology.call_s prices it at (the curve's price
    of the same shape differs by 3x), every other shape, the same rows at other heads, keys or curve
    included, keeps the curve's price."""
    from dataclasses import replace

    from megatron_patches.placement import Topology

    prof = spec_profile(8, 10.0, 10.0)
    curve = Topology.from_profile(prof)
    want = 3 * curve.call_s(1024, 512, False, 4, 64, True)
    timed = replace(prof, calls={profile.call_key("bwd", 1024, 512, 4, 64): want})
    save(timed, str(tmp_path / "c.json"))
    got = Topology.from_profile(load(str(tmp_path / "c.json")))
    assert got.profile.calls == {"bwd 1024 512 4 64": want}
    assert got.call_s(1024, 512, False, 4, 64, True) == want
    for shape in ((1024, 512, False, 4, 64, False), (512, 1024, False, 4, 64, True),
                  (1024, 512, False, 8, 64, True), (1024, 512, False, 4, 128, True)):
        assert got.call_s(*shape) == curve.call_s(*shape)


def test_curve_interpolates_log_log_and_holds_at_the_ends():
    c = Curve(((100.0, 1.0), (10000.0, 4.0)))
    assert c.tflops(10.0) == 1.0 and c.tflops(1e6) == 4.0
    assert c.tflops(1000.0) == pytest.approx(2.0)   # halfway in log size: the geometric mean


def test_a_call_takes_the_curve_of_the_nearest_measured_head_count():
    k = Kernel({1: Curve(((1.0, 1.0),)), 4: Curve(((1.0, 4.0),)), 16: Curve(((1.0, 16.0),))})
    assert [k.tflops(h, 10.0) for h in (1, 2, 3, 8, 32)] == [1.0, 4.0, 4.0, 16.0, 16.0]   # 2 and 8: ties


def test_unmeasured_group_sizes():
    prof = spec_profile(8, 10.0, 10.0)
    assert prof.collective("all_gather", 4) == Collective(3 * 3e-6, 1.0)   # ring steps at the link's rate
    measured = {**prof.collectives, "all_to_all": {2: Collective(1e-4, 0.5), 8: Collective(7e-4, 0.25)}}
    from dataclasses import replace
    prof = replace(prof, collectives=measured)
    assert prof.collective("all_to_all", 8) == Collective(7e-4, 0.25)
    near = prof.collective("all_to_all", 4)   # nearest in log size: 2 and 8 tie, the smaller wins
    assert near.alpha_s == pytest.approx(3e-4) and near.efficiency == 0.5


def _raw():
    return spec_profile(8, 10.0, 10.0).to_json()


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(format="v0"), "format='v0' must be"),
    (lambda r: r.update(format="commweave-wallfacer-profile/1"), "an older profile: measure it again"),
    (lambda r: r.update(source="guessed"), "source='guessed' is not one of"),
    (lambda r: r.update(overlap=1.5), "overlap=1.5 must be a finite number <= 1"),
    (lambda r: r.update(overlap="0.5"), "overlap='0.5' must be a finite number <= 1"),
    (lambda r: r.update(overlap=-0.2), "overlap=-0.2 is below 0, which only a CPU-clock profile may be"),
    (lambda r: r.update(gemm_tflops=0), "gemm_tflops=0 must be a finite number > 0"),
    (lambda r: r.update(ranks_per_node=0), "ranks_per_node=0 must be an integer >= 1"),
    (lambda r: r["intra"].update(gbytes=-1), "gbytes=-1 must be a finite number > 0"),
    (lambda r: r["intra"].update(alpha_us=float("nan")), "intra.alpha_us=nan must be a finite number"),
    (lambda r: r["attention"].pop("bwd"), "needs ['fwd', 'fwd_causal', 'bwd', 'bwd_causal']"),
    (lambda r: r["attention"].update(fwd={"16": [[4.0, 1.0], [2.0, 1.0]]}), "sizes [4.0, 2.0] must increase"),
    (lambda r: r["attention"].update(fwd=[[4.0, 1.0]]), "attention.fwd must map integer head counts"),
    (lambda r: r["attention"].update(fwd={"0": [[4.0, 1.0]]}), "head counts [0] must be integers >= 1"),
    (lambda r: r.update(collectives={"all_gather": {"1": {"alpha_us": 1, "efficiency": 1}}}),
     "group sizes [1] must be integers >= 2"),
    (lambda r: r.update(collectives={"all_gather": {"2": {"alpha_us": 1, "efficiency": 9}}}),
     "efficiency=9 must be <= 4"),
    (lambda r: r.update(inter=None), "inter and node_gbytes go together"),
    (lambda r: r.update(extra=1), "unknown fields ['extra']"),
    (lambda r: r.update(host=[1]), "host=[1] must map 'P U C order' to seconds"),
    (lambda r: r.update(host={"8 1": 1.0}), "host key '8 1' must be 'P U C order'"),
    (lambda r: r.update(host={"8 1 2 team-major": -1.0}), "host['8 1 2 team-major']=-1.0 must be a finite"),
    (lambda r: r.update(calls=[1]), "calls=[1] must map 'curve rows keys heads head_dim' to seconds"),
    (lambda r: r.update(calls={"fwd 512 256 8": 1.0}), "calls key 'fwd 512 256 8' is not a curve and four"),
    (lambda r: r.update(calls={"fwd_causal 512 256 8 64": 1.0}), "is a causal call off the diagonal"),
    (lambda r: r.update(calls={"bwd 512 256 8 64": 0.0}), "calls['bwd 512 256 8 64']=0.0 must be a finite"),
])
def test_bad_profiles_name_the_field(edit, message):
    raw = _raw()
    edit(raw)
    with pytest.raises(ValueError, match=None) as e:
        from_json(raw, "p.json")
    assert str(e.value).startswith("p.json: ") and message in str(e.value), str(e.value)


def test_where_auto_reads_a_profile(tmp_path, monkeypatch):
    path = str(tmp_path / "m.json")
    save(gpu_profile("h100", 8, 3200, 8, "ib"), path)
    monkeypatch.delenv(profile.ENV, raising=False)
    assert profile_path(None) is None
    cfg = WallFacerConfig(team_size="auto", placement="auto")
    assert cfg.topology(8).profile.description.startswith("public specs: 8/node, 450 GB/s")
    monkeypatch.setenv(profile.ENV, path)
    assert profile_path(None) == path and profile_path("given.json") == "given.json"
    assert cfg.topology(8).profile == load(path)
    assert WallFacerConfig(profile=path).topology(8).profile == load(path)
    with pytest.raises(ValueError, match=r"wallfacer profile '/nope\.json': must be a readable regular JSON "
                                         r"file \(no such file\)"):
        WallFacerConfig(profile="/nope.json")
    bad = tmp_path / "bad.json"
    for text, rule in (("{", "not valid JSON: Expecting property name"),
                       ('{"overlap": NaN}', "NaN is not JSON"), ('{"a": 1, "a": 2}', "duplicate key 'a'"),
                       ("[]", "the top level must be a JSON object")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"wallfacer profile '{bad}': {rule}")):
            WallFacerConfig(profile=str(bad))
    with pytest.raises(ValueError, match=re.escape(f"wallfacer profile '{tmp_path}': must be a readable "
                                                   f"regular JSON file, not a directory")):
        WallFacerConfig(profile=str(tmp_path))
