"""What makes a model unsafe under CP beyond its attention cores, found before anything runs:
modules outside the regions that mix sequence positions (`mixers`)."""
