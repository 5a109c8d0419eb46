"""The one compiled part: ``fastload.image._jpeg``, a JPEG region decoder on the system's libjpeg-turbo.

Everything else about the package is in pyproject.toml. The extension is optional: where no C compiler or
no libjpeg headers are found (Debian: ``apt-get install gcc libjpeg-dev``), the install goes on without it
and fastload decodes crops as before (nvImageCodec, else a full decode); ``fastload doctor`` says which.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fastload.image._jpeg", ["fastload/image/_jpeg.c"], libraries=["jpeg"],
                             extra_compile_args=["-O2"], optional=True)])
