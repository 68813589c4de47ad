"""OpenAI Batch API jobs served in the cold tier (issue 14): window parsing and work estimates
(:mod:`laser.batch.estimate`, torch-free) and the job runner (:mod:`laser.batch.manager`)."""
