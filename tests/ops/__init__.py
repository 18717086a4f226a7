"""Op-level tests: the fused ops against float64 references, errors, transformations."""
