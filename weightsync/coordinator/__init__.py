"""Internal. The coordinator: the named Ray actor, its pure state (version table, roster, slots,
broadcast membership) and the handle and typed control plane parties reach it through."""
