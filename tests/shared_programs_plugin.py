"""The suite's in-memory program sharing (``shared_programs.py``) in the fresh folders where it runs a team's
own tests (``conftest.run_pytest_in``): loaded there with ``-p tests.shared_programs_plugin``, so that the
folder's checks share what they compile as the suite's own workers do (a slip's check reads its match's
programs of the same pmap step, twin and inputs). It changes no number: the same key is the same program.
Loaded before the folder's ``conftest.py``: importing JAX's compiler starts no backend, so the plugin
there still chooses the device count."""

from tests import shared_programs

shared_programs.install()
