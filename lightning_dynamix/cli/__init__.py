"""The ``dynamix`` command: its entry point and the demo, report, plan and policy commands."""
