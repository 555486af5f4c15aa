# frozen_string_literal: true

require_relative 'puppet_run'
require_relative '../lib/puppet_x/vmhost/guest'

# vmhost::guest_exec and vmhost::guest_file_push, called from a manifest compiled in-process
# (Puppet's PAL) against the fake daemon: the requests they send, their answers, and the
# compile failures a refusal or a failing checked command cause.
class TestGuest < Minitest::Test
  include PuppetRun

  EXEC_ANSWER = { 'exit_code' => 0, 'signal' => nil, 'timed_out' => false, 'duration_ms' => 2,
                  'stdout' => "hi\n", 'stderr' => '', 'stdout_bytes' => 3, 'stderr_bytes' => 0,
                  'stdout_truncated' => false, 'stderr_truncated' => false, 'encoding' => 'text',
                  'slot' => 0 }.freeze

  def setup
    @answers = {}
    super
    # PAL finds the module by its directory name: a modulepath whose vmhost is this checkout.
    @modules = Dir.mktmpdir('vmhmods')
    File.symlink(File.expand_path('..', __dir__), File.join(@modules, 'vmhost'))
  end

  def teardown
    super
    FileUtils.remove_entry(@modules)
  end

  def handle(req)
    answer = @answers.fetch(req['method']) { { 'error' => { 'code' => -32_601, 'message' => 'Method not found' } } }
    answer.respond_to?(:call) ? answer.call(req) : answer
  end

  # Evaluates Puppet code (with $socket set to the fake daemon) and returns its value.
  def evaluate(code)
    Puppet::Pal.in_tmp_environment('vmhguest', modulepath: [@modules], facts: {}) do |pal|
      pal.with_script_compiler do |compiler|
        compiler.evaluate_string("$socket = '#{@fake.path}'\n#{code}")
      end
    end
  end

  def test_guest_exec_sends_the_argv_and_returns_the_answer
    @answers['vm.exec'] = { 'result' => EXEC_ANSWER }
    got = evaluate(<<~PP)
      vmhost::guest_exec('web', ['sh', '-c', 'echo hi'], {
        socket => $socket, env => { 'A' => '1' }, cwd => '/tmp', stdin => 'in', timeout_s => 5,
      })
    PP
    assert_equal EXEC_ANSWER, got
    req = @fake.request_list.first
    assert_equal 'vm.exec', req['method']
    assert_equal({ 'name' => 'web', 'argv' => ['sh', '-c', 'echo hi'], 'timeout_s' => 5, 'env' => ['A=1'],
                   'cwd' => '/tmp', 'stdin' => 'aW4=' }, req['params'])
  end

  def test_a_failing_command_is_an_answer_unless_checked
    @answers['vm.exec'] = { 'result' => EXEC_ANSWER.merge('exit_code' => 3, 'stderr' => 'no such unit') }
    got = evaluate("vmhost::guest_exec('web', ['systemctl', 'start', 'x'], { socket => $socket })['exit_code']")
    assert_equal 3, got
    err = assert_raises(Puppet::Error) do
      evaluate("vmhost::guest_exec('web', ['systemctl', 'start', 'x'], { socket => $socket, check => true })")
    end
    assert_match(/systemctl exited with status 3: no such unit/, err.message)
  end

  def test_a_refusal_fails_the_compilation_with_the_code
    @answers['vm.exec'] = { 'error' => { 'code' => 4095, 'message' => 'guest exec is off on this host',
                                         'data' => { 'kind' => 'exec_disabled', 'field' => 'name',
                                                     'details' => { 'reason' => 'host' } } } }
    err = assert_raises(Puppet::Error) { evaluate("vmhost::guest_exec('web', ['id'], { socket => $socket })") }
    assert_match(/vmhost::guest_exec: vmhostd refused vm.exec: error 4095 \(exec_disabled\)/, err.message)
  end

  def test_bad_arguments_are_refused_before_sending
    [
      "vmhost::guest_exec('web', [], { socket => $socket })",
      "vmhost::guest_exec('web', 'rm -rf /', { socket => $socket })",
      "vmhost::guest_exec('web', ['id'], { socket => $socket, shell => true })",
      "vmhost::guest_exec('web', ['id'], { socket => $socket, cwd => 'relative' })",
      "vmhost::guest_file_push('web', 'relative', 'x', { socket => $socket })",
      "vmhost::guest_file_push('web', '/x', 'x', { socket => $socket, mode => '0999' })"
    ].each do |code|
      assert_raises(Puppet::Error, code) { evaluate(code) }
    end
    assert_empty @fake.request_list
  end

  def test_guest_file_push_sends_content_with_its_sha256
    @answers['vm.file_push'] = ->(req) { { 'result' => { 'path' => req['params']['path'], 'size' => 5 } } }
    got = evaluate(<<~PP)
      vmhost::guest_file_push('web', '/etc/motd', 'hello', { socket => $socket, mode => '0600', owner => 'app', mkdir => true })
    PP
    assert_equal({ 'path' => '/etc/motd', 'size' => 5 }, got)
    assert_equal({ 'name' => 'web', 'path' => '/etc/motd', 'content' => 'aGVsbG8=', 'mkdir' => true,
                   'sha256' => '2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824',
                   'mode' => 0o600, 'owner' => 'app' }, @fake.request_list.first['params'])
  end

  def test_exit_status_and_modes
    assert_equal 143, PuppetX::Vmhost::Guest.exit_status({ 'signal' => 15 })
    assert_equal 124, PuppetX::Vmhost::Guest.exit_status({ 'signal' => 9, 'timed_out' => true })
    assert_equal 0o644, PuppetX::Vmhost::Guest.mode('0644')
    assert_equal 0o755, PuppetX::Vmhost::Guest.mode(0o755)
    assert_raises(PuppetX::Vmhost::Error) { PuppetX::Vmhost::Guest.mode('8') }
  end
end
