"""The verdict's policy: what of each run is compared, the twins and floors asked for, the diagnosis
and NOT VERIFIED decided (``judge``), what it asks to be run (``runs``), and the hints (``hints``).

May import: every room below it.
"""
