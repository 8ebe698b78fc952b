"""One router per concern: generation (completions + chat), models, health/readiness, metrics, OCM."""
