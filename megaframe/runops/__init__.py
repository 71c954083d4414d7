"""Run operations around the loop: who may write a run's folders (access/), stop signals agreed at one step
boundary (signals.py), hang and straggler detection (watchdog.py, straggler.py), injected faults for drills
(faults.py)."""
