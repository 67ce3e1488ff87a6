"""Real torch memory traces, captured or loaded into the event schema."""
