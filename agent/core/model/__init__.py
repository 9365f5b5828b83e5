"""Akri data model: names, deviceUsage values, Configuration and Instance."""
