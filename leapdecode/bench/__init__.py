"""The benchmark: datasets, the interleaved runner with peers, reports, plots and traces."""
