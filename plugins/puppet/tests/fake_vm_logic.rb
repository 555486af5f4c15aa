# frozen_string_literal: true

# The fake vmhostd VM logic the vmhost_vm catalog-run tests (test_provider.rb,
# test_performance.rb) share. Not a test itself (check.sh runs tests/test_*.rb).
# A tiny daemon: enough of vm.list / vm.get / vm.apply / vm.destroy for the provider, over the
# test's @vms (name => VM view), and the test VM web1 applied in a catalog run (PuppetRun).
module FakeVmLogic
  KERNEL_BOOT = { 'kernel' => '/srv/vmlinuz', 'initrd' => '/srv/initrd', 'cmdline' => 'console=ttyS0' }.freeze

  def setup
    @vms = {}
    super
  end

  def apply_vm(noop: false, **attrs)
    apply_resource(:vmhost_vm, noop: noop, **attrs)
  end

  def web1(**extra)
    { name: 'web1', ensure: 'running', cpu: 1, memory: '256M', boot: KERNEL_BOOT }.merge(extra)
  end

  # What #apply answers instead of applying while set (a daemon refusal).
  attr_writer :refuse

  def handle(req)
    p = req['params'] || {}
    case req['method']
    when 'vm.list' then { 'result' => @vms.values }
    when 'vm.get' then @vms[p['name']] ? { 'result' => @vms[p['name']] } : not_found
    when 'vm.apply' then apply(p['spec'], p)
    when 'vm.destroy' then { 'result' => { 'changed' => !@vms.delete(p['name']).nil?, 'vm' => nil } }
    else { 'error' => { 'code' => -32_601, 'message' => 'Method not found' } }
    end
  end

  def not_found
    { 'error' => { 'code' => 4040, 'message' => 'no VM', 'data' => { 'kind' => 'not_found', 'field' => 'name' } } }
  end

  # Like serde in the daemon: an integer member sent as a string is -32602.
  def wrong_type(value, key = nil)
    case value
    when Hash then value.map { |k, v| wrong_type(v, k) }.compact.first
    when Array then value.map { |v| wrong_type(v, key) }.compact.first
    else key if %w[cpu memory_mib disk_gib vlan vlans vlan_id].include?(key) && !value.is_a?(Integer)
    end
  end

  # Like vmhostd: only a new boot image needs replace (2002 without it); anything else is
  # changed in place, and with restart: false a running VM shows pending_restart.
  def image_drift(spec, params)
    old = @vms[spec['name']]
    return nil if old.nil? || params['replace']
    return nil if old['spec'].dig('boot', 'image') == spec.dig('boot', 'image')

    { 'error' => { 'code' => 2002,
                   'message' => "VM \"#{spec['name']}\": boot.image changes, which needs a new disk and destroys " \
                                'the old one (boot.image); pass replace: true to do that',
                   'data' => { 'kind' => 'spec_drift', 'field' => 'spec.boot.image',
                               'details' => { 'fields' => ['boot.image'] } } } }
  end

  def apply(spec, params = {})
    drift = image_drift(spec, params)
    return drift if drift

    if (field = wrong_type(spec))
      return { 'error' => { 'code' => -32_602, 'message' => "invalid type for #{field}",
                            'data' => { 'kind' => 'invalid_params', 'field' => "spec.#{field}", 'details' => nil } } }
    end
    if spec['memory_mib'].to_i < 32
      return { 'error' => { 'code' => 2001, 'message' => 'memory_mib must be at least 32',
                            'data' => { 'kind' => 'invalid_spec', 'field' => 'spec.memory_mib', 'details' => nil } } }
    end
    return { 'error' => @refuse } if @refuse
    return { 'result' => { 'changed' => false, 'vm' => @vms[spec['name']] } } if @ignore_changes

    spec = echoed({ 'state' => 'running' }.merge(spec))
    existed = @vms.key?(spec['name'])
    @vms[spec['name']] = view(spec)
    @vms[spec['name']]['pending_restart'] = existed && params['restart'] == false
    { 'result' => { 'changed' => true, 'vm' => @vms[spec['name']] } }
  end

  # Members vmhostd leaves out of a recorded spec while they have their default.
  DEFAULTS = { 'guest_exec' => true, 'cpu_policy' => 'shared', 'emulator_cpu' => false, 'tpm' => false }.freeze

  # A NIC's members vmhostd leaves out of a recorded spec while they have their default.
  NIC_DEFAULTS = { 'queues' => 1, 'mode' => 'bridge', 'trunk' => false }.freeze

  # As vmhostd records a spec: members at their default left out (a NIC's too, and its empty
  # `vlans`; `boot.secure_boot` false, a disk's `snapshot` true), `ssh.user` filled in.
  def echoed(spec)
    spec = spec.reject { |k, v| DEFAULTS.key?(k) && DEFAULTS[k] == v }
    echoed_nested(spec)
    spec['ssh'] = { 'user' => 'vmhost' }.merge(spec['ssh']) if spec['ssh'].is_a?(Hash)
    spec['nics'] = spec['nics'].map { |n| echoed_nic(n) } if spec['nics'].is_a?(Array)
    spec
  end

  def echoed_nested(spec)
    spec['boot'] = spec['boot'].reject { |k, v| k == 'secure_boot' && v == false } if spec['boot'].is_a?(Hash)
    return unless spec['disks'].is_a?(Array)

    spec['disks'] = spec['disks'].map { |d| d.is_a?(Hash) ? d.reject { |k, v| k == 'snapshot' && v == true } : d }
  end

  def echoed_nic(nic)
    return nic unless nic.is_a?(Hash)

    nic.reject { |k, v| (NIC_DEFAULTS.key?(k) && NIC_DEFAULTS[k] == v) || (k == 'vlans' && v == []) }
  end

  def view(spec)
    { 'name' => spec['name'], 'spec' => spec, 'desired_state' => spec['state'],
      'status' => spec['state'] == 'running' ? 'running' : 'stopped' }
  end
end
