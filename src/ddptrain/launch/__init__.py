"""Which launcher started us, starting local ranks, one rank's life, and its process group."""
