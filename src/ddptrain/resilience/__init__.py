"""What keeps a job honest when things go wrong: the watchdog (fail fast, hangs named), the
failure report, the non-finite guard, stop signals, and the run dir's hold."""
