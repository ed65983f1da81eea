"""What vlmrun's Qualcomm plugins (``qnn_htp``, ``genie_cpu``, ``qaihub``) share. A library, not a plugin: it has
no ``vlmrun`` entry point and the core never imports it.

=========================== ==========================================================================
:mod:`.socs`                the one SoC table (QNN soc_model, HTP arch, AI Hub device)
:mod:`.sdk`                 QAIRT SDK discovery (root, tools, libraries) with one-line errors
:mod:`.adb`                 the adb transport (argument lists, shlex-quoted remote lines, timeouts)
:mod:`.genie`               Genie: dialog configs, the libGenie ctypes binding and its worker, genie-t2t-run
:mod:`.manifest`            the QNN context-binary artifact: EP-context wrapper and :class:`ContextManifest`
=========================== ==========================================================================
"""

__version__ = "0.1.0"
