"""When to save, what, where, and how a run resumes: where a run starts (restore.py), the
policy and the components' states (checkpointer.py), snapshot files (files.py), DCP
folders (dcp.py), and a run dir on a store's uploads behind the training (uploads.py)."""
