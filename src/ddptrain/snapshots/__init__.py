"""When to save, what, where, and how a run resumes: where a run starts (restore.py), the
policy and the components' states (checkpointer.py), snapshot files (files.py) and DCP
folders (dcp.py)."""
