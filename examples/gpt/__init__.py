"""The main job's pieces (examples/train_gpt.py): data, layout, model, one run, agreement rule, report, and
the ``--atlas`` pipeline across two emulated data centers."""
