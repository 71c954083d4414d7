"""Which layout: the valid candidates (candidates), sized, timed and ranked (rank), reported (report)."""
