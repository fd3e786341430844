"""The trust machinery: stages and rank agreement, evidence against eager, observed steps, the audit cadence, the shape cache."""
