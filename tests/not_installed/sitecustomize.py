"""On PYTHONPATH, makes the packages named in OPTISERVE_NOT_INSTALLED (comma-separated) absent for
this process, as on a machine where they were never installed: `import` raises
ModuleNotFoundError and `importlib.util.find_spec` answers None."""

import os
import sys

for _name in filter(None, os.environ.get("OPTISERVE_NOT_INSTALLED", "").split(",")):
    sys.modules[_name] = None
