"""Paper-scale configs (MinPRO: Qwen3-8B/14B/30B-A3B; MIPU)."""
