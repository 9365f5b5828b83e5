"""Discovery: turning handler device lists into Instances."""
