"""Example model: a ResNet for 32x32 images as a LightningModule."""

from template.models.classifier import ImageClassifier
from template.models.resnet import cifar_resnet

__all__ = ["ImageClassifier", "cifar_resnet"]
