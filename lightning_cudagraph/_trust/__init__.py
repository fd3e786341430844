"""The trust machinery: stages and rank agreement, evidence against eager, observed steps, audits, the shape cache."""
