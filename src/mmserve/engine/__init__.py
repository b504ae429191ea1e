"""composition: the only place that holds both core/ and runner/."""
