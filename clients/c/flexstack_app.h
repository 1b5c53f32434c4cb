/* flexstack_app: register an application's own variables with a flexstack daemon.
 *
 * An application declares meters (values it measures and updates) and knobs (settings that rules or
 * `flexstack set` may change; the library calls the knob's callback), registers them under its name, and
 * then calls fs_app_poll() from its event loop. The variables appear in the daemon as app.<name>.<var>
 * (`flexstack get app.voip.loss`, `get("app.voip.loss")` in a rule) for as long as the connection lasts.
 *
 * Protocol: JSON lines on STATE_DIR/apps.sock (docs/control-api.md, "Application variables").
 * Single-threaded: call every function from one thread. All functions return 0 (or a count) on success and
 * -1 on failure; fs_app_error() then says why.
 *
 *   fs_app *a = fs_app_open(NULL);                       // $FLEXSTACK_STATE_DIR/apps.sock or /run/flexstack
 *   fs_app_meter(a, "loss", FS_F64);
 *   fs_app_knob(a, "cc", FS_STR, "cubic", on_cc, sock);  // on_cc(a, "cc", "bbr", sock) when it is set
 *   fs_app_register(a, "voip");
 *   for (;;) { fs_app_update_f64(a, "loss", measure()); fs_app_poll(a, 100); }
 */
#ifndef FLEXSTACK_APP_H
#define FLEXSTACK_APP_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A connection to the daemon's app socket. */
typedef struct fs_app fs_app;

/* Value types, as the daemon names them. */
typedef enum { FS_U64, FS_I64, FS_F64, FS_BOOL, FS_STR } fs_type;

/* Called when a knob is set: `value` is the new value as text ("bbr", "3", "0.5", "true").
 * Return 0 to accept it (the knob takes the value), or nonzero to refuse it (the write fails with
 * the message given to fs_app_refuse(), or "refused"). */
typedef int (*fs_set_cb)(fs_app *app, const char *name, const char *value, void *user);

/* Connects to `socket_path`, or with NULL to $FLEXSTACK_STATE_DIR/apps.sock (default /run/flexstack). */
fs_app *fs_app_open(const char *socket_path);

/* Declares a meter (before fs_app_register). */
int fs_app_meter(fs_app *app, const char *name, fs_type type);

/* Declares a knob with its initial value as text (NULL: zero/empty) and its set callback. */
int fs_app_knob(fs_app *app, const char *name, fs_type type, const char *initial, fs_set_cb cb, void *user);

/* Registers the declared variables as app.<name>.*; names: 1-64 of a-z 0-9 _ (the app's also '-'). */
int fs_app_register(fs_app *app, const char *name);

/* Stores a new value of one of the app's variables. */
int fs_app_update_u64(fs_app *app, const char *name, uint64_t value);
int fs_app_update_i64(fs_app *app, const char *name, int64_t value);
int fs_app_update_f64(fs_app *app, const char *name, double value);
int fs_app_update_text(fs_app *app, const char *name, const char *value);

/* Waits up to timeout_ms (0: do not wait, -1: forever) for knob writes and runs their callbacks;
 * returns how many it ran, or -1 if the connection failed. It also answers the daemon's pings: an application
 * that neither updates nor polls for the daemon's idle timeout (default 60 s) is disconnected. */
int fs_app_poll(fs_app *app, int timeout_ms);

/* Inside a set callback: the reason sent with a refusal. */
void fs_app_refuse(fs_app *app, const char *reason);

/* The socket, for the application's own poll/select loop (readable: call fs_app_poll(app, 0)). */
int fs_app_fd(const fs_app *app);

/* Why the last call failed. */
const char *fs_app_error(const fs_app *app);

/* Closes the connection: the daemon removes the variables. */
void fs_app_close(fs_app *app);

#ifdef __cplusplus
}
#endif
#endif
