"""Example data: sources that yield uint8 images, and a DataModule that augments on the device."""

from template.data.datamodule import ImageDataModule

__all__ = ["ImageDataModule"]
