"""Pipeline parallelism: an SPMD pipeline inside the user's loss (`spmd`), schedule tables
(`schedule`) and a per-stage executor that reroutes a lost stage's work (`executor`)."""
