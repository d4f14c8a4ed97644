"""What a run tells people: rank 0's console, progress, metrics.jsonl, TensorBoard (report.py);
the summary and curves plot read back from its records (summary.py); and the figures that need
every rank (metrics.py)."""
