"""What the user asked for: options, their validation, scopes and levels, batch keys."""
