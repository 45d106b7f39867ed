"""resilax: JAX training that survives device, host and slice failures."""
