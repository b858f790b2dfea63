"""The names Bazel 4's @bazel_tools loads from @rules_java, bound to the native rules."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
