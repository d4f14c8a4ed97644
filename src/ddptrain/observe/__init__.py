"""What a run tells people: rank 0's console, progress, metrics.jsonl, TensorBoard, plots
(report.py), and the figures that need every rank (metrics.py)."""
