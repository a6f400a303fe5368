"""What makes a model unsafe under CP beyond its attention cores, found before anything runs.

- `coverage.py`   every core in exactly one region of its kind, no mixer outside them, the
                  example's positions (the probe forward's checks, `compile` calls them)
- `mixers.py`     modules outside the regions that mix sequence positions, found by behaviour
- `cuts.py`       the code outside the regions, run on a window and its cut halves
                  (`cut_values.py` cuts and compares, `cut_blame.py` names the module)
- `local_length.py`  ops inside a region that read the local sequence length
- `config.py`     model features that need CP rules of their own, and how each was handled
- `tokens.py`     the local token batch the audits watch
"""
