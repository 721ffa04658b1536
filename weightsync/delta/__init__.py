"""Internal. Delta sync: buckets sent as the words that changed since the last committed version."""
