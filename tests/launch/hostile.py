"""Hostile values for launcher tests: each would run a command, become an option, a comment, a second
host or a second word somewhere between the topology file and a node, if any layer let it through.
``{mark}`` is a file path that exists only if something ran."""

HOSTILE = {
    "semicolon": "a0;touch {mark};",
    "command substitution": "a$(touch {mark})",
    "backticks": "a`touch {mark}`",
    "newline": "a0\ntouch {mark}",
    "leading dash": "-oProxyCommand=touch {mark}",
    "hash": "#a0",
    "comma": "a0,evil",
    "space": "a0 touch {mark}",
    "single quote": "a0'x",
    "double quote": 'a0"x',
    "non-ASCII": "a\u00e40",
    "dollar variable": "a$HOME",
    # IPv6 zone ids (after '%'): Python's ipaddress accepts any text there but '/' and '%' (issue 22),
    # so these name no path: they would write PWNED/OWNED into the working directory of whatever ran
    "zone id semicolon": "fe80::1%x;touch${{IFS}}PWNED;#",
    "zone id substitution": "::1%y$(id>OWNED)",
    "zone id backticks": "::1%y`touch${{IFS}}PWNED`",
    "zone id space": "fe80::1%eth0 touch PWNED",
}


def hostile(kind: str, mark) -> str:
    return HOSTILE[kind].format(mark=mark)


def ran(mark) -> bool:
    """Whether a hostile value ran: the marker exists, or a zone-id value wrote its file into the
    working directory (the tests that use this run with the marker's folder as working directory)."""
    return mark.exists() or any((mark.parent / name).exists() for name in ("PWNED", "OWNED"))

