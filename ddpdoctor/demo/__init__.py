"""The bundled demo job that `ddpdoctor demo` runs."""

from pathlib import Path

TRAIN_SCRIPT = Path(__file__).with_name("train.py")
