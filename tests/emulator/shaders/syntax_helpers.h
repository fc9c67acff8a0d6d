// Included by syntax.metal with a local #include (resolved next to the shader).
#ifndef JFM_TEST_SYNTAX_HELPERS_H_
#define JFM_TEST_SYNTAX_HELPERS_H_
inline float jfm_helper_offset() { return 0.25f; }
#endif
