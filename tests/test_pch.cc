// The translation unit that builds the tests' precompiled header (Note [Test precompiled
// header] in tests/CMakeLists.txt); it holds no code of its own.
