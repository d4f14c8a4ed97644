"""Which launcher started us, the CPU ranks' allocator, starting local ranks, one rank's life, and its process group."""
