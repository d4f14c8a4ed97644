"""When to save, what, where, and how a run resumes: the policy (checkpointer.py), snapshot
files (files.py) and DCP folders (dcp.py)."""
