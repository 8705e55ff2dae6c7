"""RAM-tier stage: owns the arena expert slots, LRU + learned pins, residency table."""
