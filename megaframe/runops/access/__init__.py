"""Who may write here: the lock on a run's folders (runlock.py), which folders a run claims and refuses
(folders.py), and whose checkpoints a checkpoint dir holds (owner.py)."""
