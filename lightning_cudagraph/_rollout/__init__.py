"""The rollout: plans a fit, climbs the ladder of levels, times them, and reports."""
