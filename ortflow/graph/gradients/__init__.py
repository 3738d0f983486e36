"""Rewrites and checks for the engine's gradient builder: ops it cannot differentiate, gets wrong or makes slow."""
