"""``ddptrain bench``: ddptrain against hand-written DDP loops and its peers (cli.py; the
jobs and loops in loops.py)."""
