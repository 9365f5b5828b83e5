"""Test doubles: stand-ins for the real things the agent talks to (API server, kubelet, the DRA
kubelet and scheduler, an ONVIF camera, an external handler, umockdev), each a product in its
own right with a docstring saying what it stands for and where it differs. Also the tests of
the doubles themselves (``test_*.py`` here)."""
