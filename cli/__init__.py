"""The ``kvbridge`` command (``[project.scripts]``): ``plan``, ``probe``, ``describe``,
``serve`` and ``bench``. Nothing in the library imports this package (an import-linter
contract)."""
