import torch
from tests import models as M
from transpiler.capture import _compiling_flag as flag
