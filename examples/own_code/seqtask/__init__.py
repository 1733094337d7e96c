"""A tiny package outside `trainer/`: next-character prediction on Python's own source, trained by config alone."""
