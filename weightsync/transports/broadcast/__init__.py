"""Internal. The broadcast transport: a collective broadcast from sender rank 0 to every receiver
(transport.py; the group in groups.py, its communicator in communicators.py, the rendezvous store
in store.py; versions taken before the barrier in ahead.py)."""
