"""dataprep."""
