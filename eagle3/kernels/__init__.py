"""The Triton kernels and their torch references, imported by module (`eagle3.kernels.ttt_attention`,
`eagle3.kernels.reference`...). Their files live in the repository's top-level kernels/ folder; a wheel installs them
here (pyproject's package-dir), so the project never takes the import name `kernels`, which Hugging Face's package
(required by transformers >= 5.25) owns."""
from pathlib import Path

_FOLDER = Path(__file__).resolve().parents[2] / "kernels"
if (_FOLDER / "reference.py").is_file():       # a source checkout: the modules sit in the top-level folder
    __path__.append(str(_FOLDER))
